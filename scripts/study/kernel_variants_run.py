"""H200: kernel time (torch.profiler) and per-call wall time of every module of gpu_exp3/index.json,
its output checked against torch SDPA in f32; torch flash / cuDNN timed the same ways beside."""
import json, os, sys, time
import numpy as np, torch, iree.runtime as rt
from torch.profiler import profile, ProfilerActivity
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIR = os.path.join(ROOT, "gpu_exp3"); OUT = os.environ.get("OUT", "/tmp")
dev = rt.get_device("cuda://0")
only = sys.argv[1:]

def kernel_ms(fn, n=5):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    tot = {}
    for e in ev:
        t = getattr(e, "device_time_total", None) or e.cuda_time_total
        tot[e.name[:60]] = tot.get(e.name[:60], 0.0) + t / 1e3 / n
    return sum(tot.values()), {k: round(v, 4) for k, v in tot.items()}

def wall_ms(fn, sync, reps=10):
    sync(fn()); best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            r = fn()
        sync(r)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e3

res = []
shapes = {}
for e in json.load(open(f"{DIR}/index.json")):
    shapes.setdefault((e["BH"], e["S"], e["D"], e.get("dtype", "f16")), []).append(e)
for (BH, S, D, DT), ents in shapes.items():
    if only and not any(o in e["name"] + s for e in ents for s in ("", "_ex2") for o in only):
        continue
    torch.manual_seed(0)
    tdt = {"f16": torch.float16, "bf16": torch.bfloat16}[DT]
    q, k, v = (torch.randn(BH, S, D, device="cuda", dtype=tdt) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float()[None], k.float()[None], v.float()[None])[0]
    flops = 4 * BH * S * S * D
    for be, nm in ((torch.nn.attention.SDPBackend.FLASH_ATTENTION, "flash"), (torch.nn.attention.SDPBackend.CUDNN_ATTENTION, "cudnn")):
        with torch.nn.attention.sdpa_kernel(be):
            f = lambda: torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None])
            kt, det = kernel_ms(f)
            wt = wall_ms(f, lambda r: torch.cuda.synchronize())
        res.append({"name": f"torch_{nm}", "BH": BH, "S": S, "D": D, "dtype": DT, "kernel_ms": round(kt, 4), "wall_ms": round(wt, 4),
                    "kernel_tflops": round(flops / kt / 1e9, 1), "kernels": det})
        print(res[-1], flush=True)
    from fmha_iree.runtime import DeviceTensor
    import fmha_iree
    hq, hk, hv = (fmha_iree.to_device(x.cpu(), "cuda://0").buffer_view() for x in (q, k, v))
    for e in ents:
        for suf in ("", "_ex2"):
            name = e["name"] + suf
            if only and not any(o in name for o in only):
                continue
            try:
                ctx = rt.SystemContext(config=rt.Config(device=dev))
                vm = rt.VmModule.copy_buffer(ctx.instance, open(f"{DIR}/{name}.vmfb", "rb").read())
                ctx.add_vm_module(vm)
                fn = ctx.modules[vm.name]["attn"]
                call = lambda: fn(hq, hk, hv)
                bv = lambda r: getattr(r, "_buffer_view", r)  # noqa: E731  (a DeviceArray wraps the HalBufferView)
                o = DeviceTensor.from_result(bv(call()), DT, "cuda://0").to_torch().float().numpy()
                err = float(np.abs(o - ref.cpu().numpy()).max())
                kt, det = kernel_ms(call)
                wt = wall_ms(call, lambda r: DeviceTensor.from_result(bv(r), DT, "cuda://0").to_numpy())
                res.append({"name": name, "BH": BH, "S": S, "D": D, "dtype": DT, "err": err, "kernel_ms": round(kt, 4), "wall_ms": round(wt, 4),
                            "kernel_tflops": round(flops / kt / 1e9, 1), "kernels": det})
            except Exception as ex:  # noqa
                res.append({"name": name, "error": repr(ex)[:400]})
            print(res[-1], flush=True)
            json.dump(res, open(f"{OUT}/kernel_variants.json", "w"), indent=1)
