import subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
from fmha_iree.mlir_templates import render_causal_tree, render_causal, render_dense
from fmha_iree.compile import dense_params
from fmha_iree.spec import KernelSpec, check_tiles
from fmha_iree.targets import Target
D = 128
t = Target.from_name("sm_80")
spec = KernelSpec("f16", "bhsd", 1, D, D, check_tiles(None, t, D, D, "f16"), t)
dp = dense_params(spec); A = dp["align"]; low = dp["lowering"]
def build(S):
    kw = dict(dtype="f16", layout="bhsd", group=1, dq=D, dv=D, align=A, lowering=low)
    fs = [render_dense(func_name="dense_dyn", **kw), render_causal(func_name="causal_dyn", blocks=2, **kw),
          render_dense(func_name="dense_st", seqlen=S, **kw), render_causal(func_name="causal_r2_st", blocks=2, seqlen=S, **kw),
          render_causal(func_name="causal_r4_st", blocks=4, seqlen=S, **kw)]
    for C in (256, 512, 1024, 2048):
        if C < S:
            fs.append(render_causal_tree(func_name=f"tree_{C}", seqlen=S, diag=C, **kw))
    src = f"/work/main/gpu_exp/exp_{S}.mlir"
    open(src, "w").write("module @exp {\n" + "\n".join(fs) + "}\n")
    t0 = time.time()
    r = subprocess.run(["iree-compile", src, "--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80", "--iree-input-type=auto",
                        "-o", f"/work/main/gpu_exp/exp_{S}.vmfb"], capture_output=True, text=True)
    return S, r.returncode, time.time() - t0, r.stderr[-1500:]
Ss = [int(x) for x in sys.argv[1:]]
with ThreadPoolExecutor(2) as ex:
    for S, rc, dt, err in ex.map(build, Ss):
        print(S, rc, "%.0fs" % dt, err if rc else "")
