import sys, time, torch, numpy as np, warnings
warnings.simplefilter("ignore")
from iree.turbine import aot
import iree.compiler.tools as ict, iree.runtime as rt
import fmha_iree.graph as G
from fmha_iree.spec import KernelSpec
from fmha_iree.targets import Target
from fmha_iree.tiles import TileConfig
from fmha_iree.compile import _CPU_FLAGS
S = int(sys.argv[1]); variant = sys.argv[2]; causal = sys.argv[3] == "b"
spec = KernelSpec("f32", "bhsd", 1, 64, 64, TileConfig(128, 128, 32, 128, 32), Target("llvm-cpu", "host"))
class V(G.RowBlocks):
    def forward(self, q, k, v, scale):
        sp, S = self.spec, self.seqlen
        R = G.CPU_ROWS
        B, Hq = q.shape[0], q.shape[1]
        q5 = q * (scale * G.LOG2E)
        kt = k.transpose(2, 3)
        outs, lses = [], []
        for r0 in range(0, S, R):
            end = r0 + R if self.causal else S
            qb = q5[:, :, r0:r0 + R]
            if variant == "kt":
                s = torch.matmul(qb, kt[..., :end])
            else:
                s = torch.matmul(qb, k[:, :, :end].transpose(2, 3))
            if self.causal:
                i = torch.arange(r0, r0 + R); j = torch.arange(end)
                s = torch.where(j[None, :] <= i[:, None], s, G.NEG_INF)
            m = s.amax(-1, keepdim=True); p = torch.exp2(s - m); l = p.sum(-1, keepdim=True)
            outs.append(torch.matmul(p, v[:, :, :end]) / l)
            if variant == "klse":
                lses.append((m + torch.log2(l)) * G.LN2)
        if variant == "klse":
            return torch.cat(outs, 2), torch.cat(lses, 2)[..., 0]
        return torch.cat(outs, 2)
q, k, v = (torch.randn(1, 8, S, 64) for _ in range(3))
from torch.export import Dim
dyn = None
if len(sys.argv) > 4 and sys.argv[4] != "none":
    dB, dH = Dim("B"), Dim("H")
    dyn = {"q": {0: dB}, "k": {0: dB}, "v": {0: dB}, "scale": None} if sys.argv[4] == "b" else {"q": {0: dB, 1: dH}, "k": {0: dB, 1: dH}, "v": {0: dB, 1: dH}, "scale": None}
if len(sys.argv) > 5:
    mod = G.RowBlocks(spec, S, causal)
else:
    mod = V(spec, S, causal)
ex = tuple(torch.randn(2, 8, S, 64) for _ in range(3)) if dyn else (q, k, v)
e = aot.export(mod, args=ex + (torch.ones(1) * 0.125,), dynamic_shapes=dyn)
flags = ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu", "--iree-llvmcpu-target-cpu=host"] + _CPU_FLAGS
t0 = time.time(); vm = ict.compile_str(str(e.mlir_module), extra_args=flags, input_type="auto"); ct = time.time() - t0
ctx = rt.SystemContext(config=rt.Config("local-task")); ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vm))
f = ctx.modules.module["main"]
a = [x.numpy() for x in (q, k, v)] + [np.array([0.125], np.float32)]
o = f(*a)
o = (o[0] if isinstance(o, tuple) else o).to_host()
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.125).numpy()
ts = []
for _ in range(3):
    t1 = time.perf_counter(); f(*a); ts.append(time.perf_counter() - t1)
tt = []
for _ in range(3):
    t1 = time.perf_counter(); torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal); tt.append(time.perf_counter() - t1)
print(S, variant, "causal" if causal else "dense", "compile %.0fs err %.1e  iree %.1f ms torch %.1f ms ratio %.2f" % (ct, np.abs(o - ref).max(), min(ts) * 1e3, min(tt) * 1e3, min(tt) / min(ts)))
