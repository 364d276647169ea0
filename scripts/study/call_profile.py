"""Where the per-call time goes: kernel times (torch.profiler sees IREE's CUDA kernels too) and
IREE runtime flag variants."""
import sys, os, time, json, subprocess
import numpy as np
A, H, D = 64, 16, 128
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.environ.get("OUT", "/tmp")

def setup(S, flags):
    import iree.runtime as rt
    if flags:
        rt.flags.parse_flags(*flags)
    from fmha_iree.runtime import get_device, DeviceTensor
    dev = get_device("cuda://0")
    ctx = rt.SystemContext(config=rt.Config(device=dev))
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, open(f"{HERE}/exp_{S}.vmfb", "rb").read()))
    B = 16384 // S
    rng = np.random.default_rng(0)
    ins = [DeviceTensor.from_host(rng.standard_normal((B, H, S // A, A, D)).astype(np.float16), "f16", "cuda://0").buffer_view() for _ in range(3)]
    return ctx.modules["exp"], ins + [np.array([D ** -0.5], np.float32)]

def timeit(f, ins, reps=10):
    o, l = f(*ins); l.to_host()
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            o, l = f(*ins)
        l.to_host()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e3

if sys.argv[1] == "flags":
    flags = json.loads(sys.argv[2])
    res = {}
    for S, fns in ((512, ["dense_st", "tree_256"]), (4096, ["dense_st", "tree_2048"])):
        mod, ins = setup(S, flags if S == 512 else None)
        for fn in fns:
            res[f"{S}:{fn}"] = round(timeit(mod[fn], ins), 3)
    print("FLAGS", flags, res, flush=True)
    sys.exit(0)

import torch
from torch.profiler import profile, ProfilerActivity
for S, fns in ((512, ["dense_st", "causal_r2_st", "tree_256"]), (4096, ["dense_st", "causal_r2_st", "tree_2048", "tree_1024"])):
    mod, ins = setup(S, None)
    for fn in fns:
        f = mod[fn]
        o, l = f(*ins); l.to_host()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(5):
                o, l = f(*ins)
            l.to_host()
            wall = (time.perf_counter() - t0) / 5 * 1e3
        ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        tot = {}
        for e in ev:
            k = e.name[:70]
            c, t = tot.get(k, (0, 0.0))
            tot[k] = (c + 1, t + e.device_time_total / 1e3 if hasattr(e, "device_time_total") else t + e.cuda_time_total / 1e3)
        ksum = sum(t for c, t in tot.values()) / 5
        print(f"== S={S} {fn}: wall {wall:.3f} ms/call, GPU kernels+memops {ksum:.3f} ms/call", flush=True)
        for k, (c, t) in sorted(tot.items(), key=lambda kv: -kv[1][1]):
            print(f"   {c // 5:3d}x {t / 5:8.3f} ms  {k}")
        prof.export_chrome_trace(f"{OUT}/trace_{S}_{fn}.json")
for flags in ([], ["--cuda_async_allocations=false"], ["--cuda_allow_inline_execution=true"], ["--device_allocator=caching"], ["--cuda_use_streams=false"]):
    r = subprocess.run([sys.executable, __file__, "flags", json.dumps(flags)], capture_output=True, text=True)
    print([l for l in r.stdout.splitlines() if l.startswith("FLAGS")] or r.stderr[-800:], flush=True)
