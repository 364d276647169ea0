"""Compile a kernel specialization to an IREE module, with an in-memory and an on-disk cache.

The disk cache (``cache.DiskCache``: where it lives, how entries are checked and protected) is
namespaced by a fingerprint of this package's source and the toolchain versions (iree-base-compiler,
iree-turbine, torch); keys add the spec, the flags and, for ``host`` CPU targets, the host CPU.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
import warnings
from pathlib import Path

from .cache import DiskCache, atomic_write, cache_root
from .spec import KernelSpec

__all__ = ["compile_flags", "compile_spec", "get_vmfb", "cache_dir", "stats", "toolchain"]

_PKG = Path(__file__).resolve().parent
_lock = threading.Lock()
_memory: dict[str, bytes] = {}
_stats = {"compiles": 0, "disk_hits": 0, "memory_hits": 0}


def stats() -> dict:
    """Counters of this process: ``compiles`` (modules built), ``disk_hits``, ``memory_hits``."""
    with _lock:
        return dict(_stats)


@functools.lru_cache(maxsize=None)
def toolchain() -> dict:
    """Versions of everything that shapes a compiled module."""
    from importlib import metadata

    out = {}
    for dist in ("iree-base-compiler", "iree-turbine", "torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


@functools.lru_cache(maxsize=None)
def _host_cpu() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return hashlib.sha256("\n".join(sorted(set(lines))).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def source_fingerprint() -> str:
    h = hashlib.sha256()
    for p in sorted(_PKG.rglob("*")):
        if p.is_file() and p.suffix in (".py", ".mlir", ".in", ".json"):
            h.update(str(p.relative_to(_PKG)).encode())
            h.update(p.read_bytes())
    h.update(json.dumps(toolchain(), sort_keys=True).encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return cache_root() / source_fingerprint()


# llvm-cpu: about 15% off a step call on the dev CPU (f32, S=1024, 2026-11-29), results within 1e-7
# and NaN rows still NaN (tests/test_api.py).
_CPU_FLAGS = ["--iree-llvmcpu-reassociate-fp-reductions", "--iree-llvmcpu-use-fast-min-max-ops"]


# GPU modules: every function takes a wait and a signal fence and returns at once
# (runtime.FmhaModule chains them), so consecutive calls queue on the device without a host round
# trip; on the H200 (2026-11-30) that took B=32 S=512 d128 from 1.57 to 0.57 ms per call.
ASYNC_FLAGS = ["--iree-execution-model=async-external"]


def compile_flags(spec: KernelSpec) -> list[str]:
    """Every iree-compile flag used for ``spec`` (target selection first)."""
    extra = _CPU_FLAGS if spec.target.backend == "llvm-cpu" else ASYNC_FLAGS
    return spec.target.compile_flags() + ["--iree-input-type=auto"] + extra


def _cache_key(spec: KernelSpec, flags: list[str]) -> str:
    blob = json.dumps({"spec": spec.as_dict(), "flags": flags, "native_exp2": native_exp2_default(spec)}, sort_keys=True)
    if spec.target.arch == "host":
        blob += _host_cpu()
    return spec.module_name + "-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def gpu_lowering(spec: KernelSpec) -> dict | None:
    """The IREE lowering config a GPU spec's tiles become: kM0 -> workgroup M, kN1 -> workgroup N,
    kN0 -> reduction over keys (K2); intrinsic and subgroups from the target family. ``None`` for
    the CPU, and for combinations IREE is left to choose (f32; RDNA with Dv >= 256)."""
    from .mlir_templates import default_lowering
    from .tiles import iree_picks_config, tuned_lowering

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
    return {**low, **tuned_lowering(spec.target.family, t, spec.dv)}


@functools.lru_cache(maxsize=64)
def _torch_module(dtype: str, layout: str, group: int, dq: int, dv: int, tiles, with_step: bool,
                  seqlens: tuple = (), batch: int = 0, kv_heads: int = 0) -> tuple[str, str]:
    """Exported torch-graph MLIR (target independent, so exported once per process) and the
    module name it carries."""
    from .graph import export_module
    from .targets import Target

    fixed = (tuple(seqlens), batch, kv_heads) if with_step else ((), 0, 0)
    spec = KernelSpec(dtype, layout, group, dq, dv, tiles, Target("llvm-cpu", "host"), *fixed)
    return export_module(spec, with_step=with_step), spec.module_name


def dense_params(spec: KernelSpec, *, fused_step: bool | None = None) -> dict | None:
    """The dense entry points' static parameters, or None when the module has none (CPU torch
    modules without ``seqlens``; GPU lowerings IREE picks; lowerings that split Dv across
    workgroups, which were not checked on a GPU).

    CPU torch modules with ``seqlens`` get ``dense_s<S>`` / ``causal_s<S>`` (``graph.RowBlocks``)
    only: ``tiled`` False (plain 4-D arguments), ``dynamic`` False (no entries for other lengths).

    ``align``: sequence lengths the dense path takes are multiples of this (the workgroup M and
    K2 tiles, so IREE sees whole tiles); ``causal_blocks``: row blocks of the causal entry point
    (it computes (NB + 1) / (2 NB) of the unmasked work); ``seqlens``: {S: diagonal block} of the
    compiled-in lengths (``causal_s<S>``, and ``dense_o_s<S>``: unmasked without LSE);
    ``causal_o``: the lengths that also get ``causal_o_s<S>`` (causal without LSE, masked);
    ``window``: {S: C} of the lengths that get ``window_s<S>`` (sliding windows of up to C keys
    before each row, ``mlir_templates.render_window``)."""
    import math

    fused = spec.target.backend != "llvm-cpu" if fused_step is None else fused_step
    if not fused:
        if not spec.seqlens:
            return None
        from .graph import CPU_ROWS

        for s in spec.seqlens:
            if int(s) <= 0 or int(s) % CPU_ROWS:
                raise ValueError(f"seqlens: {s} is not a positive multiple of {CPU_ROWS} (the CPU row block)")
        return {"align": CPU_ROWS, "causal_blocks": 0, "lowering": None, "seqlens": {int(s): None for s in spec.seqlens},
                "causal_o": [], "tiled": False, "dynamic": False, "batch": spec.batch, "kv_heads": spec.kv_heads}
    from .mlir_templates import window_block

    low = _dense_lowering(spec)
    if low is None or int(low.get("workgroup_n", spec.dv)) != spec.dv:
        return None
    align = math.lcm(int(low["workgroup_m"]), int(low["reduction_k2"]))
    seqlens = {}
    for s in spec.seqlens:
        if int(s) <= 0 or int(s) % align:
            raise ValueError(f"seqlens: {s} is not a positive multiple of this module's alignment {align}")
        seqlens[int(s)] = causal_diag(int(s), align)
    causal_o = [s for s in seqlens if s <= CAUSAL_MASKED_MAX and spec.group * s * s <= 1 << 28]
    window = {s: window_block(s, align) for s in seqlens if window_block(s, align)}
    return {"align": align, "causal_blocks": CAUSAL_BLOCKS, "lowering": low, "seqlens": seqlens,
            "causal_o": causal_o, "window": window, "tiled": True, "dynamic": True}


def dense_abi(spec: KernelSpec, *, fused_step: bool | None = None) -> dict | None:
    """What a runtime needs to call the dense entry points (``align``, ``causal_blocks``,
    ``seqlens``, ``causal_o``, ``window`` ([S, C] pairs), ``tiled``, ``dynamic``, ``batch``,
    ``kv_heads``: 0 or the fixed value the compiled-in entries need)."""
    d = dense_params(spec, fused_step=fused_step)
    if d is None:
        return None
    return {"align": d["align"], "causal_blocks": d["causal_blocks"], "seqlens": sorted(d["seqlens"]),
            "causal_o": sorted(d["causal_o"]), "window": sorted(d.get("window", {}).items()),
            "tiled": d["tiled"], "dynamic": d["dynamic"], "batch": d.get("batch", 0), "kv_heads": d.get("kv_heads", 0)}


def causal_diag(seqlen: int, align: int) -> int:
    """Diagonal block C of the causal tree at length S (S / C a power of two, C a multiple of
    ``align``): S/2 up to S=1024, else 256. The masked diagonal is computed in full (S*C/2 of
    wasted work); each level adds a dispatch and merge inputs, cheap since the levels read their
    blocks in place (commit 90e71e0). H200, B*S = 16k, H=16, d128 f16, out-only, bench.py, one run
    each (2026-11-30, commit 90e71e0; docs/bench/h200_2026-11-30d_*): blocks read in place,
    C=256 1.28 / 2.08 / 3.65 / 6.70 ms at S=2048..16384 against C=512/1024 (the earlier rule)
    1.37 / 2.17 / 3.92 / 6.93; with V^T blocks C=256 against C=512 1.67 / 2.40 / 3.81 / 6.37 vs
    1.76 / 2.50 / 3.85 / 6.45. (commit 0312255, blocks copied: C=512 best, C=256 1.68 / 2.56 / 4.14 /
    7.00; commit 30b39b7, host waits and slow copies: S/2 up to 4096 and 2048 above.)"""
    prefs = (seqlen // 2, seqlen) if seqlen <= 1024 else (256, seqlen // 2, seqlen)
    for c in prefs:
        n = seqlen // c if c and seqlen % c == 0 else 0
        if n and c % align == 0 and n & (n - 1) == 0:
            return c
    raise ValueError(f"seqlens: {seqlen} is not a multiple of the alignment {align}")


# Causal without LSE at a compiled-in length S up to this: the whole problem as ONE fused
# attention op with a [G*S, S] mask (every block computed, no partials, no merge) against the tree
# of dense blocks (which skips the masked half but pays for partials, copies and a merge). H200,
# d128 f16, B*S = 16k, bench.py (2026-11-30, commit 30b39b7, after the tree lost its host waits and
# slow copies): masked op 1.38 / 1.62 / 2.56 / 4.35 ms at S = 512 / 1024 / 2048 / 4096 against the
# tree's 1.69 / 1.72 / 2.34 / 3.48 (timed with the LSE). The mask costs G*S^2 bytes.
CAUSAL_MASKED_MAX = 1024

# Row blocks of the causal entry point: (NB + 1) / (2 NB) of the unmasked work; more blocks skip
# more but make smaller dispatches.
CAUSAL_BLOCKS = 2


def _dense_lowering(spec: KernelSpec) -> dict | None:
    if spec.target.backend == "llvm-cpu":
        # The GPU formulation built for llvm-cpu (tests): N whole, tiles from the spec.
        return {"backend": "cpu", "workgroup_m": spec.tiles.m0, "reduction_k2": spec.tiles.n0,
                "workgroup_n": spec.dv}
    return gpu_lowering(spec)


def source_mlir(spec: KernelSpec, *, fused_step: bool | None = None, with_fwd: bool = True) -> str:
    """The module's input IR. CPU: the torch graph of ``graph.py``. GPU: its ``init``/``finalize``
    plus the ``step`` of ``mlir/online_step.mlir.in`` (one fused ``online_attention`` carrying the
    tile config) and, where ``dense_params`` allows, ``dense`` / ``causal``
    (``mlir/dense.mlir.in``, ``mlir/causal.mlir.in``); those one-call entry points take a caller-owned
    workspace for their intermediates (``mlir_templates._dense_common``). ``fused_step=True`` on
    the CPU builds the GPU formulation for llvm-cpu, so its numerics can be tested where CI runs.
    GPU modules also get ``fwd`` (``kernels.general``: any lengths and mask, ``fwd_plan``);
    ``with_fwd=False`` leaves it out (tests of the other entry points, which it would only slow
    to compile)."""
    fused = spec.target.backend != "llvm-cpu" if fused_step is None else fused_step
    text, name = _torch_module(spec.dtype, spec.layout, spec.group, spec.dq, spec.dv, spec.tiles, not fused,
                               spec.seqlens, spec.batch, spec.kv_heads)
    text = text.replace(f"module @{name}", f"module @{spec.module_name}", 1)
    if not fused:
        return text
    from .mlir_templates import (render_causal, render_causal_tree, render_dense, render_dense_out, render_online_step,
                                 render_window)

    t = spec.tiles
    funcs = [render_online_step(func_name="step", dtype=spec.dtype, layout=spec.layout, group=spec.group,
                                r=t.m0, c=t.kv_chunk, dq=spec.dq, dv=spec.dv, lowering=gpu_lowering(spec))]
    dense = dense_params(spec, fused_step=fused)
    if dense:
        kw = dict(dtype=spec.dtype, layout=spec.layout, group=spec.group, dq=spec.dq, dv=spec.dv,
                  align=dense["align"], lowering=dense["lowering"], workspace=True)
        funcs.append(render_dense(func_name="dense", **kw))
        funcs.append(render_causal(func_name="causal", blocks=dense["causal_blocks"], **kw))
        for s, c in sorted(dense["seqlens"].items()):
            funcs.append(render_dense_out(func_name=f"dense_o_s{s}", seqlen=s, **kw))
            funcs.append(render_causal_tree(func_name=f"causal_s{s}", seqlen=s, diag=c, **kw))
            if s in dense["causal_o"]:
                funcs.append(render_dense_out(func_name=f"causal_o_s{s}", seqlen=s, causal=True, **kw))
            if s in dense["window"]:
                funcs.append(render_window(func_name=f"window_s{s}", seqlen=s, block=dense["window"][s], **kw))
    plan = fwd_plan(spec, fused_step=fused) if with_fwd else None
    if plan is not None:
        from .kernels.general import render_fwd

        funcs.append(render_fwd(plan, "fwd"))
    text = text.rstrip()
    assert text.endswith("}"), "unexpected exported module text"
    return text[:-1] + "\n".join(funcs) + "\n}\n"


# Workgroups that fill the GPU of each target (its SMs / CUs): ``fwd`` grows its groups of rows
# until one op launches this many. sm_80 modules are measured on an H200 (132 SMs).
_FILL_WGS = {"cuda": 132, "gfx90a": 110, "gfx942": 304, "gfx950": 256, "gfx1100": 96, "gfx1201": 64, "cpu": 8}


def _short_lowering(spec: KernelSpec, main: dict) -> dict:
    """The short-query tier (decode: Sq * G up to 16 rows): 16-row tiles, keys in 64-key steps;
    on wave32 targets two subgroups split Dv (H200, 2026-12-01: 272 GB/s at B16 Sk8192 against
    253 with one subgroup, and K2 = 128 slower, docs/BENCHMARKS.md)."""
    if main.get("backend") == "cpu":
        return {"backend": "cpu", "workgroup_m": 16, "reduction_k2": 32}
    sg = int(main.get("subgroup_size", 64))
    sgn = 2 if sg == 32 else 1
    keep = {k: v for k, v in main.items() if k in ("mma_kind", "qk_mma_kind", "qk_virtual", "subgroup_size")}
    k2 = 32 if spec.dv >= 256 else 64  # K and V tiles of 64 keys at Dv = 256 pass 64 KiB of shared memory
    return {**keep, "workgroup_m": 16, "workgroup_n": spec.dv, "reduction_k2": k2, "subgroups_m": 1, "subgroups_n": sgn,
            "workgroup_size": sg * sgn, "promote_operands": [1, 2]}


def fwd_plan(spec: KernelSpec, *, fused_step: bool | None = None):
    """The ``fwd`` entry point's plan (``kernels.general``): any lengths and mask in one call, or
    None where the module has none (CPU torch modules; gfx targets, see below; lowerings IREE
    picks itself, whose dynamic shapes get IREE's slow fallback config; lowerings that split Dv
    across workgroups). llvm-cpu builds of it (tests) unroll at most 4 groups to keep their
    compile short."""
    from .kernels.general import Plan, Tier

    fused = spec.target.backend != "llvm-cpu" if fused_step is None else fused_step
    if not fused or spec.target.backend == "rocm":
        # gfx targets: the masked edge dispatches carry ~36 dynamic sizes and offsets as push
        # constants and spill 5-21 SGPRs on gfx90a / gfx942 (iree-compile 3.13, 2026-12-01); until
        # they take fewer, gfx modules keep the plan for the shapes fwd would serve
        return None
    cpu = spec.target.backend == "llvm-cpu"
    main = {"backend": "cpu", "workgroup_m": 64, "reduction_k2": 32, "workgroup_n": spec.dv} if cpu else gpu_lowering(spec)
    if main is None or int(main.get("workgroup_n", spec.dv)) != spec.dv:
        return None
    main = {k: v for k, v in main.items() if k != "transpose_v"}
    wm, k2 = int(main["workgroup_m"]), int(main["reduction_k2"])
    import math

    cols = math.lcm(64, k2)
    fill = _FILL_WGS.get("cpu" if cpu else (spec.target.family if spec.target.family == "cuda" else spec.target.arch), 128)
    return Plan(spec.dtype, spec.layout, spec.group, spec.dq, spec.dv, Tier(main, wm), Tier(_short_lowering(spec, main), 16),
                cols=cols, rows=max(512, wm), fill_wgs=fill, max_groups=4 if cpu else 16)


def native_exp2_default(spec: KernelSpec) -> bool:
    """CUDA modules get their exp2 as ``ex2.approx`` (``ptx.py``) unless asked otherwise: on the
    H200 (2026-11-30) that took the d128 f16 attention kernel from 4.07 to 3.56 ms at M64 and made
    the 32-rows-per-warp tiles pay (2.89 ms at M256 / 8 warps; tuned_cuda.json)."""
    return spec.target.backend == "cuda"


def compile_spec(spec: KernelSpec, *, extra_flags: list[str] | None = None,
                 native_exp2: bool | None = None) -> tuple[bytes, dict]:
    """Compile ``spec`` now (no cache). Returns the vmfb and a record of how it was built.

    ``native_exp2`` (CUDA only; default ``native_exp2_default``): compile once with every
    executable's PTX dumped, replace IREE's polynomial exp2 with ``ex2.approx.ftz.f32``
    (``ptx.native_exp2``), and compile again with the patched PTX substituted
    (``--iree-hal-substitute-executable-objects-from``)."""
    import iree.compiler.tools as ict

    flags = compile_flags(spec) + list(extra_flags or [])
    mlir = source_mlir(spec)
    exp2 = native_exp2_default(spec) if native_exp2 is None else bool(native_exp2)
    if exp2 and spec.target.backend != "cuda":
        raise ValueError("native_exp2 applies to CUDA targets only")
    record = {
        "module": spec.module_name,
        "spec": spec.as_dict(),
        "toolchain": toolchain(),
        "command": ["iree-compile", "<module>.mlir", *flags, "-o", "<module>.vmfb"],
        "flags": flags,
    }
    if exp2:
        vmfb, record["native_exp2"] = _compile_native_exp2(mlir, flags)
        record["command"] = ["iree-compile", "<module>.mlir", *flags, "--iree-hal-link-executables=false",
                             "--iree-hal-dump-executable-binaries-to=<ptx>", "-o", "/dev/null", "&&",
                             "python", "-m", "fmha_iree.ptx", "<ptx>", "<patched>", "&&",
                             *record["command"][:-2], "--iree-hal-substitute-executable-objects-from=<patched>",
                             "-o", "<module>.vmfb"]
    else:
        vmfb = ict.compile_str(mlir, extra_args=flags)
    with _lock:
        _stats["compiles"] += 1
    return vmfb, record


def _compile_quiet(mlir: str, flags: list[str], out: Path) -> bytes:
    """iree-compile without echoing its per-executable "NOTE: ... substituted" lines (one per
    patched executable); anything else it prints still reaches stderr."""
    import subprocess
    import sys

    from iree.compiler.tools.binaries import find_tool

    r = subprocess.run([find_tool("iree-compile"), "-", *flags, "-o", str(out)], input=mlir.encode(),
                       capture_output=True)
    rest = "\n".join(ln for ln in r.stderr.decode(errors="replace").splitlines()
                      if not ln.startswith("NOTE: hal.executable"))
    if r.returncode:
        raise RuntimeError(f"iree-compile failed ({r.returncode}):\n{rest[-4000:]}")
    if rest.strip():
        print(rest, file=sys.stderr)
    return out.read_bytes()


def _compile_native_exp2(mlir: str, flags: list[str]) -> tuple[bytes, dict]:
    import tempfile

    import iree.compiler.tools as ict

    from .ptx import patch_dir

    with tempfile.TemporaryDirectory(prefix="fmha_iree_ptx_") as tmp:
        raw, patched = Path(tmp) / "ptx", Path(tmp) / "patched"
        ict.compile_str(mlir, extra_args=flags + ["--iree-hal-link-executables=false",
                                                   f"--iree-hal-dump-executable-binaries-to={raw}"])
        report = patch_dir(raw, patched)
        extra = [f"--iree-hal-substitute-executable-objects-from={patched}"] if report["executables_patched"] else []
        vmfb = _compile_quiet(mlir, flags + extra, Path(tmp) / "out.vmfb")
    found = vmfb.count(b"ex2.approx.ftz.f32")
    if found < report["replaced"]:
        raise RuntimeError(f"native_exp2: {report['replaced']} exp2 patched but {found} in the module "
                           "(IREE did not substitute the patched PTX)")
    return vmfb, report


def get_vmfb(spec: KernelSpec) -> bytes:
    """The compiled module for ``spec``: from memory, else the disk cache, else compiled (and
    stored there when the cache can be used; else kept in memory, with a warning)."""
    flags = compile_flags(spec)
    key = _cache_key(spec, flags)
    with _lock:
        if key in _memory:
            _stats["memory_hits"] += 1
            return _memory[key]
    disk = DiskCache(cache_dir())
    why = disk.problem()
    vmfb = None
    if why is None:
        try:
            with disk.lock(key):
                vmfb = disk.load(key, spec.as_dict())
                if vmfb is not None:
                    with _lock:
                        _stats["disk_hits"] += 1
                else:
                    vmfb, record = compile_spec(spec)
                    disk.store(key, vmfb, record)
        except OSError as e:  # read-only or vanished cache folder: keep what was compiled
            why = f"{disk.folder}: {e}"
    if why is not None:
        warnings.warn(f"fmha_iree: not using the disk cache ({why}); compiled modules stay in memory",
                      RuntimeWarning, stacklevel=2)
        if vmfb is None:
            vmfb, _ = compile_spec(spec)
    with _lock:
        _memory[key] = vmfb
    return vmfb


def clear_memory_cache():
    """Forget in-memory modules (the disk cache stays)."""
    with _lock:
        _memory.clear()



def entry_points(spec: KernelSpec) -> dict:
    """The module's functions and argument shapes/dtypes; ``?`` marks a runtime (dynamic) size."""
    from .graph import DESC_COLUMNS

    t = "i16(bf16 bits)" if spec.dtype == "bf16" else spec.dtype
    gr = spec.group * spec.tiles.m0
    seq = lambda h, d, s="?": ["?", h, s, d] if spec.layout == "bhsd" else ["?", s, h, d]  # noqa: E731
    hq = "?" if spec.group == 1 else f"{spec.group}*Hk"
    state = {"acc": [["?", "Hk", gr, spec.dv], "f32"], "m": [["?", "Hk", gr], "f32"], "l": [["?", "Hk", gr], "f32"]}
    out = {
        "init": {"args": {"carrier": [["NT", "Hk"], "i32"]}, "results": state},
        "step": {
            "args": {"q": [seq(hq, spec.dq), t], "k": [seq("Hk", spec.dq), t], "v": [seq("Hk", spec.dv), t],
                     "scale": [[1], "f32"], **state, "desc": [["P", len(DESC_COLUMNS)], "i32"]},
            "results": state,
            "desc_columns": list(DESC_COLUMNS),
        },
        "finalize": {
            "args": {**state, "out_map": [["?", "?"], "i32"], "lse_map": [["?", "?"], "i32"]},
            "results": {"out": [seq(hq, spec.dv), t], "lse": [["?", hq, "?"], "f32"]},
        },
    }
    if fwd_plan(spec) is not None:
        lay = "[B, Hq, Sq, D]" if spec.layout == "bhsd" else "[B, Sq, Hq, D]"
        out["fwd"] = {
            "args": {"q": [seq(hq, spec.dq), t], "k": [seq("Hk", spec.dq), t], "v": [seq("Hk", spec.dv), t],
                     "scale": [[], "f32 scalar"], "y": [[], "i64 scalar"], "x": [[], "i64 scalar"]},
            "results": {"out": [seq(hq, spec.dv), t], "lse": [["?", hq, "?"], "f32"],
                        "scratch": [["padded Q", "edge masks", "acc", "max", "sum"], "dropped by the caller"]},
            "note": (f"any Sq, Sk >= 1 and any CK mask in one call ({lay} layout): row s sees keys "
                     "s - y + 1 <= j < s + x (CK's coordinates, clipped to [-Sk, Sq + 1] / [-Sq, Sk + 1]); "
                     "batch lengths uniform (no cu_seqlen padding)"),
        }
    dense = dense_params(spec)
    if dense and not dense["tiled"]:
        for s in sorted(dense["seqlens"]):
            io = {"q": [seq(hq, spec.dq, s), t], "k": [seq("Hk", spec.dq, s), t], "v": [seq("Hk", spec.dv, s), t]}
            res = {"out": [seq(hq, spec.dv, s), t], "lse": [["?", hq, s], "f32"]}
            out[f"dense_s{s}"] = {"args": {**io, "scale": [[1], "f32"]}, "results": res,
                                  "note": f"every row sees every key; Sq == Sk == {s} (row blocks of plain matmul/softmax)"}
            out[f"causal_s{s}"] = {"args": {**io, "scale": [[1], "f32"]}, "results": res,
                                   "note": f"row i sees keys j <= i; Sq == Sk == {s} (row blocks, keys up to the diagonal)"}
            for kind in ("dense", "causal"):
                out[f"{kind}_o_s{s}"] = {"args": {**io, "scale": [[1], "f32"]}, "results": {"out": res["out"]},
                                         "note": f"as {kind}_s{s}, without lse"}
    elif dense:
        a, nb = dense["align"], dense["causal_blocks"]
        tiled = lambda h, d: ["?", h, f"S/{a}", a, d] if spec.layout == "bhsd" else ["?", f"S/{a}", a, h, d]  # noqa: E731
        tt = spec.dtype  # the templates take bf16 typed as bf16 (the torch entry points take i16 bits)
        io = {"q": [tiled(hq, spec.dq), tt], "k": [tiled("Hk", spec.dq), tt], "v": [tiled("Hk", spec.dv), tt]}
        res = {"out": [tiled(hq, spec.dv), tt], "lse": [["?", hq, f"S/{a}", a], "f32"]}
        # caller-owned storage for the intermediates; its size in bytes is what the exported
        # `<name>_transients_size` returns for the same arguments (mlir_templates._dense_common)
        io_s = {**io, "scale": [[1], "f32"], "workspace": [["<name>_transients_size"], "hal.buffer"]}
        out["dense"] = {"args": io_s, "results": res,
                        "note": f"every row sees every key; Sq, Sk multiples of {a}"}
        out["causal"] = {"args": io_s, "results": res,
                         "note": f"row i sees keys j <= i; Sq == Sk, a multiple of {a * nb}"}
        for s, c in sorted(dense["seqlens"].items()):
            fix = lambda shp: [s // a if x == f"S/{a}" else x for x in shp]  # noqa: E731
            sio = {n: [fix(shp), ty] for n, (shp, ty) in io_s.items()}
            sres = {n: [fix(shp), ty] for n, (shp, ty) in res.items()}
            out[f"causal_s{s}"] = {"args": sio, "results": sres,
                                   "note": f"row i sees keys j <= i; Sq == Sk == {s} (tree of dense blocks, diagonal {c})"}
            out[f"dense_o_s{s}"] = {"args": sio, "results": {"out": sres["out"]},
                                    "note": f"every row sees every key, no lse (IREE's fused attention op); Sq == Sk == {s}"}
            if s in dense["causal_o"]:
                out[f"causal_o_s{s}"] = {"args": sio, "results": {"out": sres["out"]},
                                         "note": f"row i sees keys j <= i, no lse (fused attention op, masked); Sq == Sk == {s}"}
            if s in dense["window"]:
                wio = {n: v for n, v in sio.items() if n != "workspace"}
                wio.update({"win": [[1], "i32"], "workspace": sio["workspace"]})
                out[f"window_s{s}"] = {"args": wio, "results": sres,
                                       "note": f"row i sees keys i - win[0] <= j <= i, 0 <= win[0] <= {dense['window'][s]}; "
                                               f"Sq == Sk == {s} (diagonal and previous blocks of {dense['window'][s]})"}
    return out


def _iree_tiles(spec: KernelSpec) -> dict:
    """What the CK tile became in IREE, for the manifest."""
    t = spec.tiles
    low = gpu_lowering(spec)
    out = {"work_unit_rows": t.m0, "work_unit_keys": t.kv_chunk}
    if low is None:
        out["lowering"] = None
        out["note"] = ("llvm-cpu: IREE picks vector tiles inside each work unit" if spec.target.backend == "llvm-cpu"
                       else "IREE's own attention config (see tiles.iree_picks_config)")
    else:
        out["lowering"] = low
        out["workgroup"] = [1, low["workgroup_m"], 0, 0, low["workgroup_n"]]
        out["reduction"] = [0, 0, 0, low["reduction_k2"], 0]
        out["note"] = "online_attention dims (batch, M, K1, K2, N): kM0 -> M, kN1 -> N, kN0 -> K2; kK0/kK1 = the intrinsic's K"
    return out


def build_artifact(spec: KernelSpec, out_path: str | Path, *, dump_dir: str | Path | None = None,
                   problem: dict | None = None, native_exp2: bool | None = None) -> dict:
    """Compile ``spec`` to ``out_path`` (.vmfb) with a JSON manifest beside it; return the manifest.

    For gfx targets the executables are dumped (to ``dump_dir`` or a temp dir) and the manifest gets
    an ISA report (registers, spills, LDS, matrix instructions, occupancy).
    """
    import tempfile

    from .graph import ABI_VERSION
    from .isa import isa_report

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(dump_dir) if dump_dir else Path(tmp)
        dump.mkdir(parents=True, exist_ok=True)
        vmfb, record = compile_spec(spec, extra_flags=[f"--iree-hal-dump-executable-files-to={dump}"],
                                    native_exp2=native_exp2)
        isa = isa_report(dump, spec.target.arch) if spec.target.backend == "rocm" else None
    t = spec.tiles
    manifest = {
        "format": "fmha_iree.module/1",
        "abi_version": ABI_VERSION,
        "module": spec.module_name,
        "problem": {"dtype": spec.dtype, "layout": spec.layout, "group": spec.group, "hdim": spec.dq,
                    "hdim_v": spec.dv, **(problem or {})},
        "target": {"name": spec.target.arch, "backend": spec.target.backend, "family": spec.target.family},
        "tiles": {"ck": {"kM0": t.m0, "kN0": t.n0, "kK0": t.k0, "kN1": t.n1, "kK1": t.k1}, "kv_chunk": t.kv_chunk,
                  "iree": _iree_tiles(spec)},
        "entry_points": entry_points(spec),
        "dense": dense_abi(spec),
        "toolchain": record["toolchain"],
        "flags": record["flags"],
        "command": record["command"],
        "native_exp2": record.get("native_exp2"),
        "isa": isa,
    }
    atomic_write(out_path, vmfb)
    atomic_write(out_path.with_suffix(".json"), json.dumps(manifest, indent=2).encode())
    return manifest
