"""Kernel breakdown (torch.profiler) and call time of one `fwd` call per case, on the modules of
`.gm3` (or `$MODDIR` for the generic and g4 ones); arguments pick cases by label."""
import sys, time, json, os
import torch
from torch.profiler import profile, ProfilerActivity
import fmha_iree
from fmha_iree.runtime import load

OUT = os.environ.get("OUT", "/tmp")
CASES = [  # label, module, B, Hq, Hk, Sq, Sk, mask
    ("causal S4096 fwd", ".gm3/f16_d128_g1_generic.vmfb", 4, 16, 16, 4096, 4096, "b"),
    ("causal S4096 compiled", ".gm2/f16_d128_g1.vmfb", 4, 16, 16, 4096, 4096, "b"),
    ("causal S3000 fwd", ".gm3/f16_d128_g1_generic.vmfb", 4, 16, 16, 3000, 3000, "b"),
    ("unmasked S1000 fwd", ".gm3/f16_d128_g1_generic.vmfb", 4, 16, 16, 1000, 1000, "0"),
    ("unmasked S1024 fwd", ".gm3/f16_d128_g1_generic.vmfb", 16, 16, 16, 1024, 1024, "0"),
    ("unmasked S1024 compiled", ".gm2/f16_d128_g1.vmfb", 16, 16, 16, 1024, 1024, "0"),
    ("decode B16", ".gm3/f16_d128_g4.vmfb", 16, 32, 8, 1, 8192, "b"),
    ("decode B1", ".gm3/f16_d128_g4.vmfb", 1, 32, 8, 1, 32768, "b"),
    ("chunked", ".gm3/f16_d128_g4.vmfb", 4, 32, 8, 512, 4096, "b"),
    ("window fwd", ".gm3/f16_d128_g1_generic.vmfb", 4, 16, 16, 4096, 4096, "b:1024,0"),
    ("smallest", ".gm3/f16_d128_g1_generic.vmfb", 1, 16, 16, 128, 128, "0"),
]
sel = sys.argv[1:]
mods = {}
for label, mp, B, Hq, Hk, Sq, Sk, mask in CASES:
    if sel and not any(s in label for s in sel):
        continue
    if os.environ.get("MODDIR") and ("generic" in mp or "g4" in mp):
        mp = os.environ.get("MODDIR", mp.split("/")[0]) + "/" + mp.split("/")[1]
    if mp not in mods:
        mods[mp] = load(mp, device="cuda://0")
    f = mods[mp]
    torch.manual_seed(0)
    q = torch.randn(B, Hq, Sq, 128, dtype=torch.float16)
    k = torch.randn(B, Hk, Sk, 128, dtype=torch.float16)
    v = torch.randn(B, Hk, Sk, 128, dtype=torch.float16)
    qd, kd, vd = (fmha_iree.to_device(x, "cuda://0") for x in (q, k, v))
    for _ in range(3):
        r = f(qd, kd, vd, mask=mask)
    r.wait()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(10):
            r = f(qd, kd, vd, mask=mask)
        r.wait()
        best = min(best, (time.perf_counter() - t0) / 10)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            r = f(qd, kd, vd, mask=mask)
        r.wait()
        torch.cuda.synchronize()
    tot = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kname = e.name[:90]
        c, t = tot.get(kname, (0, 0.0))
        tot[kname] = (c + 1, t + e.device_time_total / 1e3)
    ksum = sum(t for c, t in tot.values()) / 5
    print(f"== {label} [{mp}]: call {best * 1e3:.3f} ms, kernels {ksum:.3f} ms/call, {sum(c for c, _ in tot.values()) // 5} launches/call", flush=True)
    for kname, (c, t) in sorted(tot.items(), key=lambda kv: -kv[1][1])[:int(os.environ.get("TOPK", "14"))]:
        print(f"   {c / 5:5.1f}x {t / 5:8.4f} ms  {kname}")
