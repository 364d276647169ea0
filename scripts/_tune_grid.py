"""The tuning grid of ``scripts/tune.py``: lowering configs, the standalone attention module each
renders to, and compiling them (CPU machine; needs iree-base-compiler and this package)."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

T_OF = {"f16": "f16", "bf16": "bf16"}
MMA = {
    ("nv", "f16"): "NV_MMA_SYNC_F32_16x8x16_F16",
    ("nv", "bf16"): "NV_MMA_SYNC_F32_16x8x16_BF16",
    ("wmma", "f16"): "NV_WMMA_F32_16x16x16_F16",   # sm_80 target: no bf16 WMMA in IREE 3.13
    ("nvf16", "f16"): "NV_MMA_SYNC_F16_16x8x16_F16",
}
BASE_FLAGS = ["--iree-hal-target-device=cuda", "--iree-input-type=auto", "--iree-opt-const-eval=false"]
# shapes measured by `run`, per head dim: (BH, S); the first is the main shape ("B=4, H=16" at d128)
SHAPES = {64: [(128, 4096), (256, 2048)], 128: [(64, 4096), (128, 2048)], 256: [(32, 4096), (64, 2048)]}


# ----------------------------------------------------------------------------------------------
# rendering

def lowering_dict(cfg: dict, dtype: str, d: int) -> dict:
    """The render_lowering_attrs dict for a grid config."""
    sgm, sgn = int(cfg["sgm"]), int(cfg.get("sgn", 1))
    lw = {
        "workgroup_m": int(cfg["wm"]), "workgroup_n": d, "reduction_k2": int(cfg["k2"]),
        "promote_operands": list(cfg.get("promote", [1, 2])),
        "subgroup_size": 32, "subgroups_m": sgm, "subgroups_n": sgn,
        "workgroup_size": 32 * sgm * sgn,
        "mma_kind": MMA[(cfg.get("pv", "nv"), dtype)],
        "qk_mma_kind": MMA[(cfg.get("qk", "nv"), dtype)],
    }
    if cfg.get("prefetch") is not None:
        lw["prefetch_stages"] = int(cfg["prefetch"])
    return lw


def render_module(lw: dict, dtype: str, d: int, shape=(None, None, None)) -> str:
    """shape = (BH, Sq, Sk); None = dynamic. IREE 3.13 fails ("failed to distribute") when Sq and Sk
    are both dynamic with an explicit VectorDistribute config, and refuses ("Padding OnlineAttention
    without existing mask is not yet supported") with its default config."""
    from fmha_iree.codegen.mlir_templates import render_lowering_attrs

    t = T_OF[dtype]
    wm, k2 = int(lw["workgroup_m"]), int(lw["reduction_k2"])
    props, attrs = render_lowering_attrs(lw, m_total=wm * k2, dv=d, c=wm * k2)
    bh, sq, sk = (("?" if x is None else str(int(x))) for x in shape)
    qt = f"tensor<{bh}x{sq}x{d}x{t}>"
    kt = f"tensor<{bh}x{sk}x{d}x{t}>"
    at = f"tensor<{bh}x{sq}x{d}xf32>"
    mt = f"tensor<{bh}x{sq}xf32>"
    dyn = []
    dimtxt = ""
    if bh == "?":
        dimtxt += f"  %c0 = arith.constant 0 : index\n  %bh = tensor.dim %q, %c0 : {qt}\n"
        dyn.append("%bh")
    if sq == "?":
        dimtxt += f"  %c1 = arith.constant 1 : index\n  %s = tensor.dim %q, %c1 : {qt}\n"
        dyn.append("%s")
    dims = ", ".join(dyn)
    maps = ",\n        ".join([
        "affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d2)>",
        "affine_map<(d0, d1, d2, d3, d4) -> (d0, d3, d2)>",
        "affine_map<(d0, d1, d2, d3, d4) -> (d0, d3, d4)>",
        "affine_map<(d0, d1, d2, d3, d4) -> ()>",
        "affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d4)>",
        "affine_map<(d0, d1, d2, d3, d4) -> (d0, d1)>",
        "affine_map<(d0, d1, d2, d3, d4) -> (d0, d1)>"])
    scale = 1.0 / math.sqrt(d)
    id3 = "affine_map<(d0, d1, d2) -> (d0, d1, d2)>"
    id2 = "affine_map<(d0, d1, d2) -> (d0, d1)>"
    i2 = "affine_map<(d0, d1) -> (d0, d1)>"
    return f"""module {{
util.func public @attn(%q: {qt}, %k: {kt}, %v: {kt}) -> ({qt}, {mt}) {{
  %zero = arith.constant 0.0 : f32
  %fmin = arith.constant -3.40282347E+38 : f32
  %ln2 = arith.constant 0.693147180559945309 : f32
  %scale = arith.constant {scale:.9e} : {t}
{dimtxt}  %ae = tensor.empty({dims}) : {at}
  %a0 = linalg.fill ins(%zero : f32) outs(%ae : {at}) -> {at}
  %me = tensor.empty({dims}) : {mt}
  %m0 = linalg.fill ins(%fmin : f32) outs(%me : {mt}) -> {mt}
  %l0 = linalg.fill ins(%zero : f32) outs(%me : {mt}) -> {mt}
  %a:3 = iree_linalg_ext.online_attention <{{{props}
      indexing_maps = [
        {maps}]}}>{attrs}
      ins(%q, %k, %v, %scale : {qt}, {kt}, {kt}, {t})
      outs(%a0, %m0, %l0 : {at}, {mt}, {mt}) {{
  ^bb0(%sc: f32):
    iree_linalg_ext.yield %sc : f32
  }} -> {at}, {mt}, {mt}
  %oe = tensor.empty({dims}) : {qt}
  %o = linalg.generic {{indexing_maps = [{id3}, {id2}, {id3}],
                       iterator_types = ["parallel", "parallel", "parallel"]}}
      ins(%a#0, %a#2 : {at}, {mt}) outs(%oe : {qt}) {{
  ^bb0(%x: f32, %sm: f32, %o0: {t}):
    %y = arith.divf %x, %sm : f32
    %h = arith.truncf %y : f32 to {t}
    linalg.yield %h : {t}
  }} -> {qt}
  %le = tensor.empty({dims}) : {mt}
  %lse = linalg.generic {{indexing_maps = [{i2}, {i2}, {i2}], iterator_types = ["parallel", "parallel"]}}
      ins(%a#1, %a#2 : {mt}, {mt}) outs(%le : {mt}) {{
  ^bb0(%mx: f32, %sm: f32, %l0o: f32):
    %lg = math.log2 %sm : f32
    %ml = arith.addf %mx, %lg : f32
    %ln = arith.mulf %ml, %ln2 : f32
    linalg.yield %ln : f32
  }} -> {mt}
  util.return %o, %lse : {qt}, {mt}
}}
}}
"""


# ----------------------------------------------------------------------------------------------
# grid

def cfg_name(cfg: dict) -> str:
    p = "p" + "".join(str(x) for x in cfg.get("promote", [1, 2]))
    pf = f"_pf{cfg['prefetch']}" if cfg.get("prefetch") is not None else ""
    mma = "" if (cfg.get("qk", "nv"), cfg.get("pv", "nv")) == ("nv", "nv") else f"_{cfg['qk']}-{cfg['pv']}"
    fl = f"_{cfg['flag']}" if cfg.get("flag", "none") != "none" else ""
    return f"m{cfg['wm']}k{cfg['k2']}w{cfg['sgm']}x{cfg.get('sgn', 1)}_{p}{pf}{mma}{fl}"


SMEM_LIMIT = 160 * 1024  # sm_80 target: max_workgroup_memory_bytes = 166912

FLAGSETS = {
    "none": [],
    "sm90": ["--iree-cuda-target=sm_90"],     # replaces sm_80 (IREE 3.13: "missing GPU target")
    "sm89": ["--iree-cuda-target=sm_89"],     # the newest CUDA target IREE 3.13 knows
    "approxlog": ["--nvptx-approx-log2f32"],  # no --iree-codegen-gpu-native-math-precision in 3.13
}


def smem_bytes(cfg: dict, d: int, eb: int = 2) -> int:
    """Shared memory of the promoted operands (Q if promoted, K and V tiles)."""
    b = 0
    pr = cfg.get("promote", [1, 2])
    if 0 in pr:
        b += cfg["wm"] * d * eb
    if 1 in pr:
        b += cfg["k2"] * d * eb
    if 2 in pr:
        b += cfg["k2"] * d * eb
    st = max(1, int(cfg.get("prefetch") or 1))
    return b * (st if st > 1 else 1)


def coarse_grid(quick: bool) -> list[dict]:
    """f16 d128 grid, pruned to configs whose warps tile M in >= 16 rows and fit 99 KB smem."""
    out = []
    # stage A: tiles x warps, fixed promote [1,2], no prefetch, NV mma, no flags
    for wm, k2, sgm, sgn in itertools.product((64, 128), (16, 32, 64, 128), (2, 4, 8), (1, 2)):
        if wm // sgm < 16:
            continue
        if sgn == 2 and sgm == 8 and wm == 64:
            continue
        cfg = dict(wm=wm, k2=k2, sgm=sgm, sgn=sgn, promote=[1, 2], prefetch=None, qk="nv", pv="nv",
                   flag="none")
        if smem_bytes(cfg, 128) > SMEM_LIMIT:
            continue
        out.append(cfg)
    if quick:
        keep = {(64, 32, 4, 1), (64, 64, 4, 1), (128, 32, 4, 1), (128, 64, 8, 1), (128, 32, 8, 1),
                (64, 32, 2, 1), (64, 64, 2, 1), (128, 64, 4, 1), (64, 32, 4, 2), (64, 16, 4, 1),
                (64, 128, 4, 1)}
        out = [c for c in out if (c["wm"], c["k2"], c["sgm"], c["sgn"]) in keep]
    # stage B: variants around a few likely-good base tiles
    bases = [dict(wm=64, k2=32, sgm=4, sgn=1), dict(wm=128, k2=32, sgm=8, sgn=1),
             dict(wm=128, k2=64, sgm=8, sgn=1), dict(wm=64, k2=64, sgm=4, sgn=1)]
    if quick:
        bases = bases[:1]
    for b in bases:
        common = dict(promote=[1, 2], prefetch=None, qk="nv", pv="nv", flag="none")
        for var in (dict(promote=[0, 1, 2]), dict(prefetch=2), dict(qk="wmma", pv="wmma"),
                    dict(qk="nv", pv="wmma"), dict(flag="sm90"), dict(flag="sm89"), dict(flag="approxlog"),
                    dict(promote=[0, 1, 2], prefetch=2)):
            cfg = {**b, **common, **var}
            if smem_bytes(cfg, 128) > SMEM_LIMIT:
                continue
            out.append(cfg)
    seen, uniq = set(), []
    for c in out:
        n = cfg_name(c)
        if n not in seen:
            seen.add(n)
            uniq.append(c)
    return uniq


# ----------------------------------------------------------------------------------------------
# compile

def _compile_one(job: dict, outdir: Path) -> dict:
    src = outdir / f"{job['name']}.mlir"
    vmfb = outdir / f"{job['name']}.vmfb"
    src.write_text(job["mlir"])
    flags = list(BASE_FLAGS)
    extra = list(job["flags"])
    if not any(f.startswith("--iree-cuda-target=") for f in extra):
        flags.append("--iree-cuda-target=sm_80")
    flags += extra
    cmd = ["iree-compile", str(src), *flags, "-o", str(vmfb)]
    t0 = time.time()
    exp2 = None
    try:
        if job.get("native_exp2", True):
            # as the package compiles CUDA modules: IREE's polynomial exp2 replaced (fmha_iree/toolchain/ptx.py)
            from fmha_iree.toolchain.compile import compile_native_exp2

            data, exp2 = compile_native_exp2(job["mlir"], flags)
            vmfb.write_bytes(data)
            rc, err = 0, ""
        else:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=job.get("timeout", 300))
            rc, err = r.returncode, r.stderr
    except subprocess.TimeoutExpired:
        rc, err = -1, "timeout"
    except Exception as e:  # noqa: BLE001 (a failed config is a row of the sweep, not a crash)
        rc, err = 1, str(e)
    dt = time.time() - t0
    ent = {k: job[k] for k in ("name", "config", "lowering", "dtype", "d", "mode", "shape", "BH", "S")}
    ent.update(flags=flags, compile_s=round(dt, 1), command=" ".join(cmd), native_exp2=exp2)
    if rc == 0:
        ent["file"] = vmfb.name
        ent["size"] = vmfb.stat().st_size
    else:
        ent["error"] = _short_err(err)
        vmfb.unlink(missing_ok=True)
    return ent


def _short_err(err: str) -> str:
    lines = [ln for ln in err.splitlines() if "error" in ln.lower()]
    return (" | ".join(lines[:3]) if lines else err[-600:])[:800]


SHAPE_MODES = ("dynbh", "static", "dynsq", "dynsk", "dyn")


def shape_of(mode: str, bh: int, s: int):
    """(BH, Sq, Sk) with None = dynamic, for a shape mode."""
    return {"dynbh": (None, s, s), "static": (bh, s, s), "dynsq": (None, None, s),
            "dynsk": (None, s, None), "dyn": (None, None, None)}[mode]


def make_job(cfg: dict, dtype: str, d: int, mode: str = "dynbh", shape_i: int = 0) -> dict:
    bh, s = SHAPES[d][shape_i]
    lw = lowering_dict(cfg, dtype, d)
    shape = shape_of(mode, bh, s)
    name = f"{dtype}_d{d}_{cfg_name(cfg)}_S{s}" + ("" if mode == "dynbh" else f"_{mode}")
    return dict(name=name, config=cfg, lowering=lw, dtype=dtype, d=d, mode=mode, shape=list(shape),
                BH=bh, S=s, flags=FLAGSETS[cfg.get("flag", "none")],
                mlir=render_module(lw, dtype, d, shape))


def other_dims_cfgs(dtype: str, d: int, quick: bool = False) -> list[dict]:
    """A few plausible configs for the non-f16-d128 problems (first run, before the coarse results)."""
    base = dict(promote=[1, 2], prefetch=None, qk="nv", pv="nv", flag="none")
    cfgs = [dict(wm=64, k2=32, sgm=4, sgn=1), dict(wm=128, k2=32, sgm=8, sgn=1),
            dict(wm=128, k2=64, sgm=8, sgn=1), dict(wm=64, k2=64, sgm=4, sgn=1)]
    if quick:
        cfgs = cfgs[:2]
    out = []
    for c in cfgs:
        for var in (({},) if quick else ({}, dict(promote=[0, 1, 2]), dict(prefetch=2))):
            c2 = {**base, **c, **var}
            while smem_bytes(c2, d) > SMEM_LIMIT and c2["k2"] > 16:
                c2["k2"] //= 2
            if c2 not in out:
                out.append(c2)
    return out


def _top_configs(path, n):
    res = json.loads(Path(path).read_text())
    rows = [r for r in res["rows"] if r.get("ok") and r["dtype"] == "f16" and r["d"] == 128
            and r.get("mode", "dynbh") == "dynbh" and r["S"] == SHAPES[128][0][1]]
    rows.sort(key=lambda r: r["ms"])
    top = []
    for r in rows:
        if r["config"] not in top:
            top.append(r["config"])
        if len(top) >= n:
            break
    return top
