"""CPU: the group-mode call inside an exported model (one fmha_fwd_varlen call site, mask b, f32)
with the loop's kernel at ROWS rows per tile (0: the module's kM0, 256) for H query heads over HK
KV heads of D: a decode of 16 one-token sequences over 1024 keys, one 2048-token prefill and four
of 512, best of 3 (ms).
    python docs/bench/model_varlen_rows.py ROWS H HK D
The figures: docs/BENCHMARKS.md, "fmha_iree inside an exported model" (the CPU's group mode)."""
import sys, time, numpy as np, torch
import iree.runtime as rt
import fmha_iree.integrations.model_op as mo
from fmha_iree.integrations.model_export import export_model, compile_model
from fmha_iree.integrations.torch_ops import fmha_fwd_varlen
rows = int(sys.argv[1])
mo.CPU_LOOP_ROWS = rows or None  # the module's kM0 where 0
class M(torch.nn.Module):
    def forward(self, q, k, v, sq, sk):
        return fmha_fwd_varlen(q, k, v, sq, sk, mask="b")
H, HK, D = (int(x) for x in sys.argv[2:5])
q = torch.randn(10, H, D); k = torch.randn(12, HK, D); v = torch.randn(12, HK, D)
sq = torch.tensor([0, 4, 10], dtype=torch.int32); sk = torch.tensor([0, 5, 12], dtype=torch.int32)
Dm = lambda n: torch.export.Dim(n, max=1 << 16)
mlir = export_model(M(), (q, k, v, sq, sk), target="host", dynamic_shapes={"q": {0: Dm("a")}, "k": {0: Dm("b")}, "v": {0: Dm("b")}, "sq": {0: Dm("c")}, "sk": {0: Dm("c")}})
compile_model(mlir, target="host", output=f"rows{rows}.vmfb")
ctx = rt.SystemContext(config=rt.Config("local-task"))
ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, open(f"rows{rows}.vmfb", "rb").read()))
f = ctx.modules.module["main"]
def st(l): return np.concatenate([[0], np.cumsum(l)]).astype(np.int32)
rng = np.random.default_rng(0)
for name, lq, lk in (("decode16x1024", [1]*16, [1024]*16), ("prefill1x2048", [2048], [2048]), ("prefill4x512", [512]*4, [512]*4)):
    Q = rng.standard_normal((sum(lq), H, D)).astype(np.float32); K = rng.standard_normal((sum(lk), HK, D)).astype(np.float32); V = K.copy()
    args = (Q, K, V, st(lq), st(lk))
    f(*args)
    ts = []
    for _ in range(3):
        t0 = time.perf_counter(); np.asarray(f(*args).to_host()); ts.append(time.perf_counter() - t0)
    print(rows, name, round(min(ts) * 1e3, 2), "ms", flush=True)
