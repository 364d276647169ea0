"""Build the 2026-11-30 (commit 30b39b7) kernel variants of ONE fused `attention` op (f16, [BH, S, D]
static), each twice: as IREE emits it and with its exp2 expansions replaced by ex2.approx
(fmha_iree.ptx.native_exp2, substituted back with --iree-hal-substitute-executable-objects-from).
Writes gpu_exp3/<name>[_ex2].vmfb and gpu_exp3/index.json.
Usage: kernel_variants_build.py [S BH D [DTYPE [VARIANT...]]]"""
import json, os, subprocess, sys, shutil
HERE = os.path.dirname(os.path.abspath(__file__)); ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT); sys.path.insert(0, HERE)
from kernel_variants_mk import module
from fmha_iree.ptx import native_exp2
OUT = os.path.join(ROOT, "gpu_exp3")
F = ["--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80", "--iree-input-type=auto"]
S, BH, D = (int(x) for x in sys.argv[1:4]) if len(sys.argv) > 3 else (4096, 64, 128)
DT = sys.argv[4] if len(sys.argv) > 4 else "f16"
PICK = sys.argv[5:]
V = {
    "m64k32w4": {"wm": 64, "k2": 32, "sgm": 4},
    "m128k32w4": {"wm": 128, "k2": 32, "sgm": 4},
    "m128k32w8": {"wm": 128, "k2": 32, "sgm": 8},
    "m64k64w4": {"wm": 64, "k2": 64, "sgm": 4},
    "m64k16w4": {"wm": 64, "k2": 16, "sgm": 4},
    "vt_m64k32w4": {"wm": 64, "k2": 32, "sgm": 4, "vt": 1},
    "vt_m64k64w4": {"wm": 64, "k2": 64, "sgm": 4, "vt": 1},
    "vt_m128k16w4": {"wm": 128, "k2": 16, "sgm": 4, "vt": 1},
    "vt_m128k32w4": {"wm": 128, "k2": 32, "sgm": 4, "vt": 1},
    "vt_m128k32w8": {"wm": 128, "k2": 32, "sgm": 8, "vt": 1},
    "iree_default": None,
    "m256k32w8": {"wm": 256, "k2": 32, "sgm": 8},
    "vt_m256k32w8": {"wm": 256, "k2": 32, "sgm": 8, "vt": 1},
    "m128k64w4": {"wm": 128, "k2": 64, "sgm": 4},
    "vt_m128k64w4": {"wm": 128, "k2": 64, "sgm": 4, "vt": 1},
    "m128k16w8": {"wm": 128, "k2": 16, "sgm": 8},
    "vt_m128k16w8": {"wm": 128, "k2": 16, "sgm": 8, "vt": 1},
    "m256k16w8": {"wm": 256, "k2": 16, "sgm": 8},
    "m256k64w8": {"wm": 256, "k2": 64, "sgm": 8},
}
index = []
for name, cfg in V.items():
    if PICK and name not in PICK:
        continue
    src = module(cfg, DT, D, BH, S)
    mp = f"/tmp/kv_{name}.mlir"; open(mp, "w").write(src)
    d1, d2 = f"/tmp/kv_{name}_d1", f"/tmp/kv_{name}_d2"
    for d in (d1, d2):
        shutil.rmtree(d, ignore_errors=True); os.makedirs(d)
    tag = f"{name}_S{S}_d{D}" + ("" if DT == "f16" else f"_{DT}")
    r = subprocess.run(["iree-compile", mp, *F, "--iree-hal-link-executables=false",
                        f"--iree-hal-dump-executable-binaries-to={d1}", "-o", f"{OUT}/{tag}.vmfb"], capture_output=True, text=True)
    if r.returncode:
        print(name, "FAILED", r.stderr[-500:]); continue
    rep = {}
    for f in os.listdir(d1):
        t, rp = native_exp2(open(f"{d1}/{f}").read())
        rep[f] = rp.__dict__
        if rp.replaced:
            open(f"{d2}/{f.rsplit('_cuda_nvptx_fb', 1)[0]}.ptx", "w").write(t)
    r = subprocess.run(["iree-compile", mp, *F, f"--iree-hal-substitute-executable-objects-from={d2}",
                        "-o", f"{OUT}/{tag}_ex2.vmfb"], capture_output=True, text=True)
    print(name, rep, "ok" if not r.returncode else r.stderr[-300:], flush=True)
    index.append({"name": tag, "cfg": cfg, "S": S, "BH": BH, "D": D, "dtype": DT, "vt": bool(cfg and cfg.get("vt")), "exp2": rep})
p = f"{OUT}/index.json"
old = json.load(open(p)) if os.path.exists(p) else []
json.dump([e for e in old if e["name"] not in {i["name"] for i in index}] + index, open(p, "w"), indent=1)
