"""What a module holds: its entry points, their static parameters and lowering configs, rendered as
MLIR (the input ``compile.py`` hands to iree-compile).

Every module has the plan's ``init`` / ``finalize`` (torch graphs, ``graph.py``) and ``step`` (an
MLIR template; on GPUs at the head dims ``step_compute`` gives). CPU modules add ``rows.py``'s torch
graphs and the functions of ``source_cpu``; GPU modules the one-call
entry points (``mlir_templates``), ``fwd`` (``kernels.general``) and ``fwd_ragged``
(``kernels.ragged``), each where its parameters allow (``dense_params``, ``fwd_plan``);
``entries.entry_points`` describes them for the manifest.
"""

from __future__ import annotations

import dataclasses
import functools

from ..problem.spec import KernelSpec

__all__ = ["source_mlir", "has_plan", "is_fused", "gpu_lowering", "step_compute", "dense_params",
           "fwd_plan", "native_exp2_default", "CAUSAL_MASKED_MAX"]


def is_fused(spec: KernelSpec, fused_step: bool | None = None) -> bool:
    """Whether ``spec`` builds the GPU formulation: GPU targets, llvm-cpu when asked (tests), and
    ALiBi and bias modules on every target (their one path, ``fwd_tiles``, is the GPU formulation's)."""
    if spec.tiles_only:
        return True
    return spec.target.backend != "llvm-cpu" if fused_step is None else fused_step


def scale_on_scores(spec: KernelSpec) -> bool:
    """Whether the attention ops apply the softmax scale to the f32 scores instead of to Q (a
    lowering's ``scale_on_scores``, ``kernels.attention``): bf16 on ROCm, where IREE's bf16
    multiply of Q is emulated (gfx942, gfx1100): it spilled gfx1100's d256 ``step`` (90 VGPRs;
    none with the scale on the scores) and cost a gfx942 ``fwd`` op many instructions
    (docs/BENCHMARKS.md, "bf16's scale on the scores"). CUDA (sm_80 multiplies bf16
    with ``fma.rn.bf16``) keeps IREE's form."""
    return spec.target.backend == "rocm" and spec.dtype == "bf16"


# The soft-cap's form per target (``mlir_templates.scores.softcap_lines``; a lowering's
# ``softcap_exp2``), chosen by the registers of the f16 / bf16 d128 32:8 bshd ``--softcap 50``
# builds (iree-compile 3.13, docs/BENCHMARKS.md "Score variants"): gfx1100 spilled with math.tanh
# (f16 2, bf16 24 VGPRs) and with the exact division (bf16 70), not with the approximate one;
# gfx1201 f16 spilled 14 with the approximate division, none with the exact one; CDNA spills with
# none of them but takes up to 65 more VGPRs per op with exp2, so keeps tanh. CUDA: tanh's
# polynomial cost the H100's B4 H16 S4096 causal prefill 35% (ex2.approx and an approximate
# division instead). The GPU formulation built for llvm-cpu takes the exp2 form, so that its
# tests check it (the CPU's own templates check tanh).
_SOFTCAP_FORM = {"gfx1100": "fast", "gfx1201": True, "cuda": "fast", "host": True}


def _scale_form(spec: KernelSpec, low: dict) -> dict:
    """``low`` with ``scale_on_scores`` set where :func:`scale_on_scores` asks for it, and the
    soft-cap's form where ``_SOFTCAP_FORM`` gives one."""
    form = _SOFTCAP_FORM.get(spec.target.family if spec.target.family == "cuda" else spec.target.arch)
    if spec.softcap and form:
        low = {**low, "softcap_exp2": form}
    return {**low, "scale_on_scores": True} if scale_on_scores(spec) else low


def gpu_lowering(spec: KernelSpec) -> dict | None:
    """The IREE lowering config a GPU spec's tiles become: kM0 -> workgroup M, kN1 -> workgroup N,
    kN0 -> reduction over keys (K2); intrinsic and subgroups from the target family. ``None`` for
    the CPU, and for combinations IREE is left to choose (f32; RDNA with Dv >= 256)."""
    from .mlir_templates import default_lowering
    from ..problem.tiles import iree_picks_config, tuned_lowering

    if spec.target.backend == "llvm-cpu" or iree_picks_config(spec.target.family, spec.dtype, spec.dv, spec.target.arch, spec.dq):
        return None
    t = spec.tiles
    # default_lowering gives the intrinsic and subgroup shape of the family (it declines RDNA
    # Dv >= 256, which iree_picks_config already screened); the tile fields are overridden below.
    base = default_lowering(spec.target.arch, dtype=spec.dtype, r=t.m0, group=spec.group, c=t.kv_chunk,
                            dv=min(spec.dv, 128))
    if base is None:
        return None
    n1 = t.n1 if spec.dv % t.n1 == 0 else spec.dv
    # One subgroup per 16 rows of kM0: at most 4 waves on AMD (the default tables), 8 warps on
    # CUDA; the tuned CUDA tiles bring their own warp layout (tiles.tuned_lowering).
    most = 8 if spec.target.family == "cuda" else 4
    low = {**base, "workgroup_m": t.m0, "workgroup_n": n1, "reduction_k2": t.n0, "subgroups_m": min(most, t.m0 // 16)}
    return _scale_form(spec, {**low, **tuned_lowering(spec.target.family, t, spec.dv)})


@functools.lru_cache(maxsize=64)
def _torch_module(dtype: str, layout: str, group: int, dq: int, dv: int, tiles, cpu: bool,
                  seqlens: tuple = (), batch: int = 0, kv_heads: int = 0, softcap: float = 0.0) -> tuple[str, str]:
    """Exported torch-graph MLIR (target independent, so exported once per process) and the
    module name it carries."""
    from .graph import export_module
    from ..problem.targets import Target

    fixed = (tuple(seqlens), batch, kv_heads, softcap) if cpu else ((), 0, 0)
    spec = KernelSpec(dtype, layout, group, dq, dv, tiles, Target("llvm-cpu", "host"), *fixed)
    return export_module(spec, with_rows=cpu), spec.module_name


def dense_params(spec: KernelSpec, *, fused_step: bool | None = None) -> dict | None:
    """The dense entry points' static parameters, or None when the module has none (CPU torch
    modules without ``seqlens``; GPU lowerings IREE picks; lowerings that split Dv across
    workgroups, which were not checked on a GPU).

    CPU torch modules with ``seqlens`` get ``dense_s<S>`` / ``causal_s<S>`` (``rows.RowBlocks``)
    only: ``tiled`` False (plain 4-D arguments), ``dynamic`` False (no entries for other lengths).

    ``align``: sequence lengths the dense path takes are multiples of this (the workgroup M and
    K2 tiles, so IREE sees whole tiles); ``seqlens``: the compiled-in lengths (GPU:
    ``dense_o_s<S>``, unmasked without LSE); ``causal_o``: those that also get ``causal_o_s<S>``
    (causal without LSE, one masked op). Causal with the LSE and sliding windows at a compiled-in
    length run through the generic entries: the causal tree and the window entries that served them
    were no faster (docs/BENCHMARKS.md, "Paths with a contract: before and after")."""
    import math

    fused = is_fused(spec, fused_step)
    if spec.tiles_only:
        return None
    if not fused:
        if not spec.seqlens:
            return None
        from .rows import CPU_ROWS

        for s in spec.seqlens:
            if int(s) <= 0 or int(s) % CPU_ROWS:
                raise ValueError(f"seqlens: {s} is not a positive multiple of {CPU_ROWS} (the CPU row block)")
        return {"align": CPU_ROWS, "lowering": None, "seqlens": {int(s): None for s in spec.seqlens},
                "causal_o": [], "tiled": False, "dynamic": False, "batch": spec.batch, "kv_heads": spec.kv_heads}
    low = _dense_lowering(spec)
    if low is None or int(low.get("workgroup_n", spec.dv)) != spec.dv:
        return None
    align = math.lcm(int(low["workgroup_m"]), int(low["reduction_k2"]))
    seqlens = {}
    for s in spec.seqlens:
        if int(s) <= 0 or int(s) % align:
            raise ValueError(f"seqlens: {s} is not a positive multiple of this module's alignment {align}")
        seqlens[int(s)] = None
    causal_o = [s for s in seqlens if s <= CAUSAL_MASKED_MAX and spec.group * s * s <= 1 << 28]
    return {"align": align, "lowering": low, "seqlens": seqlens,
            "causal_o": causal_o, "tiled": True, "dynamic": True}


# Causal without LSE at a compiled-in length S up to this: the whole problem as ONE fused
# attention op with a [G*S, S] mask (every block computed, no partials, no merge) against the tree
# of dense blocks (which skips the masked half but pays for partials, copies and a merge): the op
# won up to S = 1024 on the H200, the tree above (docs/thresholds.md, "Causal out-only: one masked
# op against the tree"). The mask costs G*S^2 bytes.
CAUSAL_MASKED_MAX = 1024



def _dense_lowering(spec: KernelSpec) -> dict | None:
    if spec.target.backend == "llvm-cpu":
        # The GPU formulation built for llvm-cpu (tests): N whole, tiles from the spec; the scale on
        # the scores where scale_on_scores says so (never for the CPU itself: tests force it).
        return _scale_form(spec, {"backend": "cpu", "workgroup_m": spec.tiles.m0, "reduction_k2": spec.tiles.n0,
                                  "workgroup_n": spec.dv})
    return gpu_lowering(spec)


def has_plan(spec: KernelSpec, *, fused_step: bool | None = None, with_fwd: bool = True,
             with_ragged: bool = True) -> bool:
    """Whether the module carries the host tile plan (``init`` / ``step`` / ``finalize``): every CPU
    module (its paths fall back on it: DeviceTensors in group mode, padding past ``rows``), and GPU
    modules without both ``fwd`` and ``fwd_ragged``, which take every batch and group problem
    between them (the plan would never be called: ``paths.select``)."""
    fused = is_fused(spec, fused_step)
    if spec.tiles_only:
        return False
    return not fused or not (with_fwd and with_ragged) or fwd_plan(spec, fused_step=fused) is None


def source_mlir(spec: KernelSpec, *, fused_step: bool | None = None, with_fwd: bool = True,
                with_ragged: bool = True) -> str:
    """The module's input IR. Modules with the host tile plan (``has_plan``): ``init`` / ``finalize``
    of ``graph.py`` and the plan's ``step`` of ``mlir/online_step.mlir.in`` (one fused
    ``online_attention`` carrying the tile config).
    CPU: with the CPU gathers and lowering, ``step_open``, ``units`` / ``waves_varlen`` and in bshd
    ``rows_packed`` (``source_cpu``), and ``rows.py``'s entry points. GPU: where ``dense_params`` allows, ``dense``
    (``mlir/dense.mlir.in``) and the compiled-in lengths' entries; those one-call entry points take a caller-owned
    workspace for their intermediates (``mlir_templates.dense._dense_common``). ``fused_step=True`` on
    the CPU builds the GPU formulation for llvm-cpu, so its numerics can be tested where CI runs.
    GPU modules (and those CPU builds) also get ``fwd`` (``kernels.general``: any lengths and
    mask, ``fwd_plan``; RDNA ones below Dv 256);
    ``with_fwd=False`` leaves it out (tests of the other entry points, which it would only slow
    to compile), ``with_ragged=False`` leaves out ``fwd_ragged`` (``kernels.ragged``) beside it."""
    fused = is_fused(spec, fused_step)
    if spec.tiles_only:  # fwd_tiles alone, the slopes or bias an argument (kernels.tiles.tiles_module)
        from .kernels.tiles import tiles_module

        return tiles_module(fwd_plan(spec, fused_step=True), spec.module_name)
    plan_too = has_plan(spec, fused_step=fused, with_fwd=with_fwd, with_ragged=with_ragged)
    if plan_too:
        text, name = _torch_module(spec.dtype, spec.layout, spec.group, spec.dq, spec.dv, spec.tiles, not fused,
                                   spec.seqlens, spec.batch, spec.kv_heads, spec.softcap)
        text = text.replace(f"module @{name}", f"module @{spec.module_name}", 1)
    else:
        text = f"module @{spec.module_name} {{\n}}\n"
    if not fused:
        from .source_cpu import cpu_functions

        return _with_funcs(text, cpu_functions(spec))
    from .mlir_templates import render_dense, render_dense_out, render_online_step

    t = spec.tiles
    funcs = []
    if plan_too:
        dims, low = step_compute(spec)
        funcs.append(render_online_step(func_name="step", dtype=spec.dtype, layout=spec.layout, group=spec.group,
                                        r=t.m0, c=t.kv_chunk, dq=spec.dq, dv=spec.dv, lowering=low, compute_dims=dims,
                                        softcap=spec.softcap))
    dense = dense_params(spec, fused_step=fused)
    if dense:
        kw = dict(dtype=spec.dtype, layout=spec.layout, group=spec.group, dq=spec.dq, dv=spec.dv,
                  align=dense["align"], lowering=dense["lowering"], workspace=True, softcap=spec.softcap)
        funcs.append(render_dense(func_name="dense", **kw))
        for s, c in sorted(dense["seqlens"].items()):
            funcs.append(render_dense_out(func_name=f"dense_o_s{s}", seqlen=s, **kw))
            if s in dense["causal_o"]:
                funcs.append(render_dense_out(func_name=f"causal_o_s{s}", seqlen=s, causal=True, **kw))
    plan = fwd_plan(spec, fused_step=fused) if with_fwd else None
    if plan is not None:
        from .kernels.general import render_fwd
        from .kernels.ragged import render_packed, render_ragged
        from .kernels.tiles import render_tiles

        funcs.append(render_fwd(plan, "fwd"))
        if with_ragged:
            # groups of 256 state rows: each computes only the frame's entries with rows in it
            # (kernels.ragged), so finer groups skip more (docs/thresholds.md, "GPU ragged row groups")
            funcs.append(render_ragged(dataclasses.replace(plan, ragged=True, rows=256), "fwd_ragged"))
            for name, paged in (("fwd_tiles", False), ("fwd_tiles_paged", True)):
                tiles = render_tiles(plan, name, paged=paged)
                if tiles is not None:
                    funcs.append(tiles)
            if plan.layout == "bshd" and not plan.pads:  # keys read in place as rows of [N, R, H, D]
                funcs.append(render_packed(dataclasses.replace(plan, ragged=True), "fwd_packed"))
                funcs.append(render_packed(dataclasses.replace(plan, ragged=True), "fwd_packed_paged", "gathered"))
                funcs.append(render_packed(dataclasses.replace(plan, ragged=True), "fwd_packed_pages", "pages"))
    return _with_funcs(text, funcs)


def step_compute(spec: KernelSpec) -> tuple[tuple[int, int], dict | None]:
    """The head dims the GPU ``step`` computes at and its lowering. Head dims without tiles of
    their own (96, 192) are computed zero-padded to the next tiled ones (``tiles.compute_head_dim``,
    as ``fwd`` and CK's kK0max do): IREE's own config at 96 / 192 has no MFMA / WMMA, at 128 / 256
    it has. The padded op keeps the module's rows and key chunk (the plan's units), with the V
    columns per workgroup (kN1) and at most the rows of the padded dims' default tile. f32 stays
    at its own dims (no matrix intrinsic to gain), as do padded dims the target refuses
    (``tiles.not_supported_reasons``)."""
    from ..problem.tiles import not_supported_reasons

    padded = _padded_heads(spec)
    dims, t, wide, tg = (padded.dq, padded.dv), spec.tiles, padded.tiles, spec.target
    if dims == (spec.dq, spec.dv) or spec.dtype == "f32" or (
            tg.family != "cpu" and not_supported_reasons(wide, tg.family, tg.arch, *dims, spec.dtype)):
        return (spec.dq, spec.dv), gpu_lowering(spec)
    rows = min(t.m0, wide.m0)
    rows = rows if t.m0 % rows == 0 else t.m0
    return dims, gpu_lowering(dataclasses.replace(padded, tiles=dataclasses.replace(t, m0=rows, n1=wide.n1)))


def _with_funcs(text: str, funcs: list[str]) -> str:
    """The exported module ``text`` with the rendered functions ``funcs`` added."""
    if not funcs:
        return text
    text = text.rstrip()
    assert text.endswith("}"), "unexpected exported module text"
    return text[:-1] + "\n".join(funcs) + "\n}\n"


# Workgroups that fill the GPU of each target (its SMs / CUs): ``fwd`` grows its groups of rows
# until one op launches this many. sm_80 modules are measured on an H200 (132 SMs).
_FILL_WGS = {"cuda": 132, "gfx90a": 110, "gfx942": 304, "gfx950": 256, "gfx1100": 96, "gfx1201": 64, "cpu": 8}


def _short_lowering(spec: KernelSpec, main: dict, short: dict | None = None) -> dict:
    """The short-query tier (decode: Sq * G up to 16 rows): 16-row tiles, keys in 64-key steps;
    on wave32 targets two subgroups split Dv (faster than one at B16 Sk8192 on the H200, and K2 = 128
    slower: docs/thresholds.md, "GPU short tier"). ``short``: fields the main
    tier's lowering sets for this tier (``mlir_templates.lowering.rdna_fwd_lowering``)."""
    if main.get("backend") == "cpu":
        return {"backend": "cpu", "workgroup_m": 16, "reduction_k2": 32}
    sg = int(main.get("subgroup_size", 64))
    sgn = 2 if sg == 32 else 1
    keep = {k: v for k, v in main.items() if k in ("mma_kind", "qk_mma_kind", "qk_virtual", "subgroup_size",
                                                    "qk_promote_operands", "scale_on_scores", "softcap_exp2")}
    # K and V tiles of 64 keys at Dv = 256 pass 64 KiB of shared memory; on gfx9 64-key tiles
    # spilled 2-30 SGPRs in the GQA split-KV kernels (iree-compile 3.13), 32 none
    k2 = 32 if spec.dv >= 256 or spec.target.backend == "rocm" else 64
    low = {**keep, "workgroup_m": 16, "workgroup_n": spec.dv, "reduction_k2": k2, "subgroups_m": 1, "subgroups_n": sgn,
           "workgroup_size": sg * sgn, "promote_operands": [1, 2]}
    if spec.target.family == "rdna" and spec.dv >= 256:  # four waves along Dv (RDNA_D256's comment)
        from .mlir_templates.lowering import RDNA_SHORT_D256

        low.update(RDNA_SHORT_D256)
    return {**low, **(short or {})}


def fwd_plan(spec: KernelSpec, *, fused_step: bool | None = None):
    """The ``fwd`` entry point's plan (``kernels.general``): any lengths and mask in one call, or
    None where the module has none (CPU torch modules; gfx11 at Dv >= 256,
    ``mlir_templates.lowering.rdna_fwd_lowering``, which gives gfx12 at Dv >= 256 a layout of its
    own; lowerings IREE picks itself, whose dynamic shapes get IREE's slow fallback config;
    lowerings that split Dv across workgroups). llvm-cpu builds of it (tests) unroll at most 4
    groups to keep their compile short."""
    from .kernels.general import Plan, Tier

    fused = is_fused(spec, fused_step)
    if not fused:
        return None
    cpu = spec.target.backend == "llvm-cpu"
    arg_dims = (spec.dq, spec.dv)
    spec = _padded_heads(spec)
    main = {"backend": "cpu", "workgroup_m": 64, "reduction_k2": 32, "workgroup_n": spec.dv} if cpu else gpu_lowering(spec)
    if spec.target.family == "rdna":
        from .mlir_templates import rdna_fwd_lowering

        main = rdna_fwd_lowering(main, arch=spec.target.arch, dtype=spec.dtype, dv=spec.dv)
    if main is None or int(main.get("workgroup_n", spec.dv)) != spec.dv:
        return None
    short = main.get("short")
    main = _scale_form(spec, {k: v for k, v in main.items() if k not in ("transpose_v", "short")})
    wm, k2 = int(main["workgroup_m"]), int(main["reduction_k2"])
    import math

    cols = math.lcm(64, k2)
    fill = _FILL_WGS.get("cpu" if cpu else (spec.target.family if spec.target.family == "cuda" else spec.target.arch), 128)
    return Plan(spec.dtype, spec.layout, spec.group, spec.dq, spec.dv, Tier(main, wm), Tier(_short_lowering(spec, main, short), 16),
                cols=cols, rows=max(512, wm), fill_wgs=fill, max_groups=4 if cpu else 16,
                dq_arg=arg_dims[0], dv_arg=arg_dims[1], mask_blocks=spec.target.backend == "cuda",
                banded=spec.target.backend != "rocm", tiles=spec.target.backend != "rocm" or _rocm_tiles(spec, wm),
                softcap=spec.softcap, alibi=spec.alibi, bias=spec.bias)


def _rocm_tiles(spec: KernelSpec, rows: int) -> bool:
    """Whether a gfx module carries ``fwd_tiles``: where its kernels compiled on MFMA / WMMA with
    no spill (iree-compile 3.13, ``fwd_tiles`` alone for every gfx target x f16 / bf16 x head dims
    32 / 64 / 128 / 256, docs/BENCHMARKS.md "`fwd_tiles` on gfx targets"): all
    but gfx1100 f16 at 64 (31 VGPRs in the edge op) and those whose K / V steps overflow the
    target's LDS (``tiles.lds_estimate`` of the ops' ``rows`` x 64-key steps: at 256 73728
    bytes, as gfx90a's refusal said, over every 64 KB target; gfx950's 160 KB compiled clean).
    No AMD GPU has run them: the path is the CUDA proxy's (H100 / H200), chosen by the same rules."""
    from .kernels.tiles import GPU_K2, GPU_ROWS
    from ..problem.tiles import LDS_LIMIT, TileConfig, lds_estimate

    d = max(spec.dq, spec.dv)
    step = TileConfig(min(rows, GPU_ROWS), GPU_K2, 16, d, 16)
    fits = lds_estimate(step, d, d, 2) <= LDS_LIMIT.get(spec.target.arch, 65536)
    return fits and not (spec.target.arch.startswith("gfx11") and 32 < d < 128)


def _padded_heads(spec: KernelSpec) -> KernelSpec:
    """``spec`` at the head dims ``fwd`` computes with (``tiles.compute_head_dim``), with the
    default tiles of those where they differ."""
    from ..problem.tiles import compute_head_dim, default_tiles

    dq, dv = compute_head_dim(spec.dq), compute_head_dim(spec.dv)
    if (dq, dv) == (spec.dq, spec.dv):
        return spec
    t = spec.target
    return dataclasses.replace(spec, dq=dq, dv=dv, tiles=default_tiles(t.family, dq, dv, t.arch, spec.dtype))


def native_exp2_default(spec: KernelSpec) -> bool:
    """CUDA modules get their exp2 as ``ex2.approx`` (``ptx.py``) unless asked otherwise: on the
    H200 it made the d128 f16 attention kernel faster and the 32-rows-per-warp tiles pay
    (tuned_cuda.json; docs/thresholds.md, "CUDA exp2")."""
    return spec.target.backend == "cuda"


def _iree_tiles(spec: KernelSpec) -> dict:
    """What the CK tile became in IREE, for the manifest."""
    t = spec.tiles
    low = gpu_lowering(spec)
    out = {"work_unit_rows": t.m0, "work_unit_keys": t.kv_chunk}
    if low is None:
        out["lowering"] = None
        out["note"] = ("llvm-cpu: IREE picks vector tiles inside each work unit" if spec.target.backend == "llvm-cpu"
                       else "IREE's own attention config (see tiles.iree_picks_config)")
        dims, step_low = step_compute(spec) if spec.target.backend != "llvm-cpu" else ((spec.dq, spec.dv), None)
        if dims != (spec.dq, spec.dv):
            out["note"] += f"; the plan's step computes at head dims {dims[0]} / {dims[1]}, zero-padded (step_compute)"
            out["step_lowering"] = step_low
    else:
        out["lowering"] = low
        out["workgroup"] = [1, low["workgroup_m"], 0, 0, low["workgroup_n"]]
        out["reduction"] = [0, 0, 0, low["reduction_k2"], 0]
        out["note"] = "online_attention dims (batch, M, K1, K2, N): kM0 -> M, kN1 -> N, kN0 -> K2; kK0/kK1 = the intrinsic's K"
    return out
