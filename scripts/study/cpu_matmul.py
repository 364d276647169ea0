import sys, time, torch, numpy as np
from iree.turbine import aot
import iree.compiler.tools as ict, iree.runtime as rt
which = sys.argv[1]; H, M, N, K = [int(x) for x in sys.argv[2:6]]; extra = sys.argv[6:]
class QK(torch.nn.Module):
    def forward(self, a, b): return torch.matmul(a, b.transpose(1, 2))
class PV(torch.nn.Module):
    def forward(self, a, b): return torch.matmul(a, b)
if which == "qk": mod, a, b = QK(), torch.randn(H, M, K), torch.randn(H, N, K)
else: mod, a, b = PV(), torch.randn(H, M, K), torch.randn(H, K, N)
e = aot.export(mod, args=(a, b))
flags = ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu", "--iree-llvmcpu-target-cpu=host"] + extra
vm = ict.compile_str(str(e.mlir_module), extra_args=flags, input_type="auto")
ctx = rt.SystemContext(config=rt.Config("local-task")); ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vm))
f = ctx.modules.module["main"]; an, bn = a.numpy(), b.numpy()
dev = ctx.config.device
ad, bd = rt.asdevicearray(dev, an), rt.asdevicearray(dev, bn)
f(ad, bd)
ts = []
for _ in range(10):
    t = time.perf_counter(); r = f(ad, bd); r.to_host(); ts.append(time.perf_counter() - t)
tt = []
for _ in range(10):
    t = time.perf_counter(); mod(a, b); tt.append(time.perf_counter() - t)
fl = 2 * H * M * N * K
print(which, H, M, N, K, extra, "iree %.2f ms %.0f GF/s | torch %.2f ms %.0f GF/s" % (min(ts)*1e3, fl/min(ts)/1e9, min(tt)*1e3, fl/min(tt)/1e9))
